"""``python -m services.switchable --role prefill|decode [--flags]``: run one worker that can switch role."""
from services.switchable.service import SwitchableWorker
from services.worker.config import WorkerConfig
from shared.bus import service_main


def main(argv=None) -> None:
    service_main(SwitchableWorker, WorkerConfig, argv, switchable=True)


if __name__ == "__main__":
    main()
