"""Pure money and capacity: the offers' funnel and effective price (offers.py), the expected cost of a
voice-minute (selection.py), capacity at a voice target (capacity.py), the bill (bill.py), what each machine
showed (machines.py), the benchmark session report (report.py)."""
