"""The OpenAI-compatible HTTP gateway (``switchyard gateway``): OpenAI requests onto Kafka.

``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not) become queries on
``queries``; the answer is the query's ``Result`` from ``results``, or, while streaming,
the chunks workers relay on the gateway's own ``relay.<id>`` topic (``gateway.relay``).
``GET /v1/models`` lists the cluster's models and groups. API keys map to tenants
(``gateway.auth``); ``gateway.app`` holds the handlers.
"""
