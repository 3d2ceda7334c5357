"""The zoo: small models written the way public model zoos write them (model files)."""
