"""fanroute services: each sub-package is one process that talks to the others only through Kafka."""
