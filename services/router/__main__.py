"""``python -m services.router [--flags]``: run the router (NATS API ``di.v1.generate``)."""
import asyncio
import logging
import sys

from services.router.service import RouterService
from services.router.config import RouterConfig
from shared.config import load_config


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(RouterConfig, argv if argv is not None else sys.argv[1:])
    sys.exit(asyncio.run(RouterService(config).run_forever()))


if __name__ == "__main__":
    main()
