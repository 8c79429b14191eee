"""Loops over many hosts, each a module of functions taking a Context: up.py (and the offers it draws on,
offers.py; the standby pool, standby.py), reconcile.py, rotation.py (health, thermal, reprice), sizing.py
(hosts sized to calls), destroy.py, status.py (what the record says), daemon.py (all of it on schedules)."""
