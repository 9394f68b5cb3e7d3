"""The client floor: finding and joining what runs. Which Ray cluster to join and how
(`cluster`: an address named or found, Ray's token authentication followed), and where a named
service runs (`records`: what `serve` leaves on its machine). A trainer rank stands on this
floor and the wire only, so `trainer/` needs neither the data plane nor the control plane;
`service/` uses it too. It imports nothing of tokenmill but `wire/`.
"""
