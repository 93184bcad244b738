"""``python -m services.prefill [--flags]``: run one prefill worker."""
from services.prefill.service import PrefillService
from services.worker.base import main_for


def main(argv=None) -> None:
    main_for(PrefillService, "prefill", argv)


if __name__ == "__main__":
    main()
