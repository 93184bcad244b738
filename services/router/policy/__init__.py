"""The router's placement, migration and planning policies: pure, deterministic objects the simulator runs too."""
