"""The loraplane Kubernetes operator (kopf): BaseModelServer and LoRAAdapter controllers.

`loraplane_operator.main.run_operator` starts it; `builders` and `adapter_status` are pure and
unit-tested; `handlers` holds the thin kopf handlers.
"""
