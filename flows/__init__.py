"""lowerflow's Prefect flows: one model (``lower_model``) and a fleet (``lower_fleet``)."""
