"""Facts every layer shares, importing nothing above: settings from fleet.toml (config.py), the tables and
the host's states (models.py), the only SQL (record.py), errors, who owns a host (ownership.py), crash
points for tests (failpoints.py), fleet's own keys (keys.py)."""
