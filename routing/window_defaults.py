"""The window rules' defaults (``routing.window``), in a module that imports nothing, so the
command line can show them without loading pydantic or numpy."""

UNLIMITED_USD = 1e12  # Budget needs a finite number: "no budget" is this much
MAX_BATCH = 1000  # most queries the router is asked about in one window
MAX_HOLD_S = 60.0  # a query waiting for capacity (or a live instance) gives up after this
BUDGET_HOLD_S = 2.0  # a query deferred for budget gives up after this
