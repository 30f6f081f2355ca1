"""gpuswarm.client: the one client of the coordinator's HTTP API, and the job owner's and reader's commands.

Imports proto only (and the root package's leaf modules), so `pip install gpuswarm` runs it without torch,
hivemind or the coordinator's database stack.
"""
