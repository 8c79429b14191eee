"""One host, one step at a time: SSH (remote.py), the image's host scripts (ops.py), the bring-up's phase
table (bringup.py) and the instance it waits on (instance.py), probes and bench (measure.py), the standby
pool's resume (resume.py), and the end of a host (teardown.py). Each step takes a Context."""
