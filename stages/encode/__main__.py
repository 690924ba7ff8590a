from stages.encode import command

command()
