"""The shared cluster's books: what each job and team held, waited and lost, and what it cost;
worked out from the jobs' own records (pure: no Ray, no storage calls)."""
