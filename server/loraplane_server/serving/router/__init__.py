"""`loraplane router`: a pass-through proxy that sends each adapter's requests to the server pods holding it
(rendezvous ranking, a load bound, spill of hot adapters), with its pod pool and metrics.

May import: serving.bounded_labels.
"""
