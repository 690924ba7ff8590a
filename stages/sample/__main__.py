from stages.sample import command

command()
