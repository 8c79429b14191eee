"""fleet: keep rented GPU hosts serving llama-server, verified."""

__version__ = "0.1.0"
