"""Scale-out on Ray Serve: one OpenAI endpoint (an ingress deployment) in front of N engine replicas, each with its
own KV cache, routed by prefix-cache affinity. Needs `pip install -e ".[ray]"`; see docs/scale-out.md."""
