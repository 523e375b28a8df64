"""``mlx-gateway tune``: measure the served model on this machine under a serving
workload, one setting of the scheduling flags at a time, and recommend flags.

- :mod:`gateway.tuning.workload`: the requests (a burst sharing a system prompt,
  interactive streams, agent-size prompts; or a replayed request log) and how one run of
  them is measured over HTTP;
- :mod:`gateway.tuning.sweep`: the settings tried, each against a fresh ``serve``
  process, within a time budget, and the recommendation;
- :mod:`gateway.tuning.report`: the progress bar, the table and the PNG plot.
"""
