import os; os.environ["TRITON_INTERPRET"] = "1"
