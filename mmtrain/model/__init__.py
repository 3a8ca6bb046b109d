"""Models, written for one device; parallel plans wrap them (mmtrain.parallel)."""
