"""What several test modules share: the clusters they start (`clusters`), the processes they
watch (`procs`, `ray_procs`), network namespaces (`netns`), and small helpers taken out of the
test modules that first needed them. Test modules import from here, never from each other."""
