"""``python -m services.decode [--flags]``: run one decode worker."""
import asyncio
import logging
import sys

from services.decode.service import DecodeService
from shared.config import WorkerConfig, load_config


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(WorkerConfig, argv if argv is not None else sys.argv[1:], role="decode")
    asyncio.run(DecodeService(config).run_forever())


if __name__ == "__main__":
    main()
