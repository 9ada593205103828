"""The routing service: a Faust app on ``queries`` that routes in windows (DESIGN.md).

- ``streams.app`` — the Faust app and agent (``take_events`` windows, overlapped with
  routing), the batch producer, and why the processing guarantee is at-least-once plus
  Redis idempotence rather than Faust's exactly-once mode;
- ``streams.service`` — one window end to end (validate → dead letters, dedupe,
  snapshots, ``Router.decide``, budget and slot reservations, produce, acknowledge),
  holding what cannot be placed yet; no Faust in it, so it is tested in-process;
- ``streams.views`` — instance views and the window budget from Redis state (pure);
- ``streams.policy`` — the policy by name (``routing.policies``) or ``module:factory``;
- ``streams.metrics`` — the router's Prometheus metrics.

Delivery contract: an input offset is committed only after every message the window
produced for it was acknowledged by Kafka and its route was recorded in Redis; a query
is routed at most once per id (a redelivered one already routed is dropped; the only
window for a second route is a crash between Kafka's acknowledgement and the Redis
mark, one round trip); reservations are idempotent per id, so nothing is paid or
slotted twice. Inputs are acknowledged to Faust in offset order per partition
(``OrderedAcker``), so a held query keeps every later offset of its partition
uncommitted until it is finished.
"""
