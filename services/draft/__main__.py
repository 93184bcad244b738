"""``python -m services.draft``: run one draft service (config from DEEPINFER_* env, then flags)."""
from services.draft.service import main

if __name__ == "__main__":
    main()
