from stages.train import command

command()
