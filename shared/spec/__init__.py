"""Speculative decoding: drafters that propose tokens, the confidence head that trims proposals, and the
acceptance rules the engine verifies them with (``shared/engine`` runs verification)."""
