"""The cache-tier service: KV blocks in DRAM and on SSD, served to workers over NATS (see ``service.py``)."""
