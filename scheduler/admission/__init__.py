"""What enters a model's batch and when: the waiting queue's order (latency class, fair
share, cached prefix), the latency-class rules, requests on their way, next-turn precomputes."""
