"""``python -m services.prefill [--flags]``: run one prefill worker."""
import asyncio
import logging
import sys

from services.prefill.service import PrefillService
from shared.config import WorkerConfig, load_config


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(WorkerConfig, argv if argv is not None else sys.argv[1:], role="prefill")
    asyncio.run(PrefillService(config).run_forever())


if __name__ == "__main__":
    main()
