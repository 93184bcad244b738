"""``python -m services.decode [--flags]``: run one decode worker."""
from services.decode.service import DecodeService
from services.worker.base import main_for


def main(argv=None) -> None:
    main_for(DecodeService, "decode", argv)


if __name__ == "__main__":
    main()
