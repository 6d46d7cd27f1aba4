"""The cluster's configuration and the rules every part applies the same way: the config types
the simulator, the live services and the policies read (`cluster`, `live`), and the limits a
request is held to (`limits`)."""
