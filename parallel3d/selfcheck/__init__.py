"""The selftest's library side (launch/selftest.py is the command): its layouts as data (layouts.py), the
comparison of a layout's run with world size 1's (parity.py), bus bandwidth through parallel3d.comm beside
the planner's figure (bandwidth.py), and the one table it prints (report.py)."""
