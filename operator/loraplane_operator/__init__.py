"""The loraplane Kubernetes operator (kopf). Arrives with the operator issue."""
