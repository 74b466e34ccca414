import sys

from chunkcache.router.app import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
