"""The output transaction: storage access, the output folder's layout, the lock and the commit."""
