"""Chat templates fleet ships for its profiles (`chat_template` in fleet.toml names one by file name):
the originals as their makers publish them, and fleet's repairs beside them (each says what it changes)."""
