"""``python -m services.router [--flags]``: run the router (NATS API ``di.v1.generate``)."""
from services.router.config import RouterConfig
from services.router.service import RouterService
from shared.bus import service_main


def main(argv=None) -> None:
    service_main(RouterService, RouterConfig, argv)


if __name__ == "__main__":
    main()
