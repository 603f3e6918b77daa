import subprocess
import sys


def test_importing_the_agent_pulls_in_no_server_or_ui_library() -> None:
    code = (
        "import sys, trainwarden.agent as tw\n"
        "heavy = [m for m in ('fastapi', 'sqlalchemy', 'dash', 'plotly', 'starlette', 'alembic', 'flask') "
        "if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
