"""``python -m services.cache_tier``: run one cache tier (config from DEEPINFER_* env, then flags)."""
from services.cache_tier.service import main

if __name__ == "__main__":
    main()
