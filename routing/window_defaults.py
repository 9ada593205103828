"""The window rules' defaults (``routing.window``), in a module that imports nothing, so the
command line can show them without loading pydantic or numpy."""

UNLIMITED_USD = 1e12  # Budget needs a finite number: "no budget" is this much
MAX_BATCH = 1000  # most queries the router is asked about in one window
MAX_HOLD_S = 60.0  # a query waiting for capacity (or a live instance) gives up after this
BUDGET_HOLD_S = 2.0  # a query deferred for budget gives up after this
# load shedding (``routing.window.shed``), off by default: held queries may wait out a
# rebalance or an instance restart far past their SLO and still be served (reliability.md)
SHED_BACKLOG = 0  # past this many queries waiting in the router, shed the excess; 0: off
SHED_AFTER_SLO = 0.0  # shed a query that waited this many times its TTFT SLO; 0: off
