"""``python -m services.switchable --role prefill|decode [--flags]``: run one worker that can switch role."""
import asyncio
import logging
import sys

from services.switchable.service import SwitchableWorker
from services.worker.config import WorkerConfig
from shared.config import load_config


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(WorkerConfig, argv if argv is not None else sys.argv[1:], switchable=True)
    sys.exit(asyncio.run(SwitchableWorker(config).run_forever()))


if __name__ == "__main__":
    main()
