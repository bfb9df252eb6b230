import sys, tempfile
from tests.helpers import train
def main():
    lay = sys.argv[1].split()
    extra = sys.argv[2].split()
    d = tempfile.mkdtemp()
    a = train(lay + extra, d + "/a")
    b = train(["parallelism=none"] + extra, d + "/b")
    for x, y in zip(a, b):
        print(x["step"], x["loss"], y["loss"], x["loss"]/y["loss"]-1, x["grad_norm"], y["grad_norm"], x["grad_norm"]/y["grad_norm"]-1)
if __name__ == "__main__":
    main()
