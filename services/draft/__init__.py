"""The draft service: proposes speculative tokens for decode workers over NATS (see ``service.py``)."""
