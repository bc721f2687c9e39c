from gpu_watchdog.cli.main import main

raise SystemExit(main())
