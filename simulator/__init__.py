"""The discrete-event cluster simulator behind `deepinfer simulate`."""
