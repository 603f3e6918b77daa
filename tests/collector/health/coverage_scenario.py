"""An epoch's end as the agent reports it (shared by the coverage and sample tests)."""

from __future__ import annotations

import time
import uuid
from typing import Any

T0 = time.time() - 3600


def epoch_end(epoch: int, last: int, size: int, kept: int | None = None) -> dict[str, Any]:
    kept = kept or size
    return {
        "id": uuid.uuid4().hex,
        "kind": "epoch_end",
        "ts": T0 + 1,
        "step": last,
        "data": {
            "epoch": epoch,
            "last_step": last,
            "dataset_size": size,
            "kept": kept,
            "exact": kept == size,
        },
    }
