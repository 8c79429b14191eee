"""The agents' one endpoint per [[serve]] target: HAProxy carries the calls (TLS at both ends, streams
unbuffered, health checks, per-host limits, stick tables), fleet is its control plane: the desired state
is derived from the record (targets.py), rendered once as HAProxy's configuration (haproxy.py) and applied
on every change through its Runtime API (runtime.py, sync.py), without a reload."""
