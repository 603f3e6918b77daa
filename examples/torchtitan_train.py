"""torchtitan's ``train.py`` observed by trainwarden: the one change is
``tw_torchtitan.build_trainer(config)`` in place of ``config.build()``. It needs CUDA
GPUs and torchtitan 0.3; run it from a torchtitan checkout, whose llama3 debug model is
built in code and trains on the repository's own test assets (its tokenizer and the
``c4_test`` dataset: no download):

    pip install 'trainwarden[torchtitan]'
    export TRAINWARDEN_URL=http://collector:8000 TRAINWARDEN_TOKEN=... TRAINWARDEN_RUN=tt-debug
    cd torchtitan && torchrun --nproc-per-node 8 /path/to/examples/torchtitan_train.py \\
        --module llama3 --config llama3_debugmodel --training.steps 50

(``bench/torchtitan_check.py`` is the same, checked: what ``scripts/gpu_check.sh`` runs.)
"""

from __future__ import annotations

import torch
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger

from trainwarden.agent.integrations import torchtitan as tw_torchtitan  # trainwarden


def main() -> None:
    init_logger()
    config = ConfigManager().parse_args()
    trainer = tw_torchtitan.build_trainer(config)  # trainwarden: for config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
