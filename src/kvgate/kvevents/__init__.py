"""vLLM's KV cache events, spoken by kvgate: the wire format (``wire``), a publisher (``publisher``) and a
subscriber (``subscriber``).

Pure messaging: this layer imports only kvgate's bottom layer (errors), so the gateway (which publishes
its tiers' changes) and the router (which reads engines' and gateways' events) both stand on it.
"""
