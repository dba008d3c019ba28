"""Getting a Ray cluster (attach, start a local one, simulate nodes), `megaray up` and its pools,
Ray's token, Ray's private APIs, and the processes megaray owns."""
