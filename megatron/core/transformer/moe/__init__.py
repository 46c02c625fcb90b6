"""Mixture of Experts: router, token dispatchers, experts and the MoE layer."""
