"""DLRM on Criteo click logs: data source, feature transforms, synthetic data generator."""
