"""Offline calibration: make a task's scheduler profile (`entmtp calibrate`), and replay policies on traces.

traces.py     calibration traces (every position's rank vector from one teacher-forced pass of the heads) and
              a profile's traces sidecar (save_traces, load_traces)
search.py     EntMTP's greedy tree growth, the acceptance frontier, exact own-tree simulation
replay.py     policies and the hindsight oracle replayed on traces with measured latencies
calibrate.py  the calibration pipeline (traces, search, latency, frontiers, tuning): builds a Profile
plots.py      the frontier plot of a profile
command.py    `entmtp calibrate`

It stands above the engine (it decodes to measure) and the scheduler (it builds profiles and replays its
policies); nothing below imports it.
"""
