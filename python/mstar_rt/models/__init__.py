"""Model families served by mstar_rt (import the submodules; they need torch)."""
